"""What the HTTP server talks to: the EngineClient protocol (client.py) and what implements
it: one engine in this process (local.py), the Ray replicas' front (replicas/front.py), and
the coming model store."""
