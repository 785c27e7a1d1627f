"""`pagedllm serve --replicas N`: the same API as a Ray Serve application, an ingress
deployment (HTTP, keys, limits, tokenizing) in front of N engine replicas, each with its own
KV pool and threads, routed by which replica already holds a request's leading KV blocks.

Only this package imports Ray, and nothing outside it imports this package except the CLI
when --replicas is given: the single-process server never loads Ray.

    launch.py          starts Ray and the application, waits for signals (SIGHUP, SIGTERM)
    ingress.py         the ingress deployment: the usual FastAPI app over a front
    front.py           ReplicaClient: the EngineClient the app sees instead of one engine
    engine_replica.py  the engine deployment: one LLMEngine and its loop thread per replica
    router.py          prefix-cache-aware request router (Ray Serve's RequestRouter API)
    board.py           a small actor where replicas post their figures and read policies
"""
