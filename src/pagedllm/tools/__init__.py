"""The user's tools on top of the core: the load benchmark (bench*), capacity planning
(plan), the terminal chat and the prompt texts they share. Nothing in core imports them."""
