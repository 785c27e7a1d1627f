"""Structured output: requests whose tokens must follow a grammar (a JSON schema, a regex, a
list of choices, a Lark or GBNF grammar). spec.py is plain data (what a request asked for);
compiler.py turns it into llguidance matchers on the HTTP side, never on the engine loop;
mask.py applies the matchers' token masks to a batch of logits in the sampler."""
