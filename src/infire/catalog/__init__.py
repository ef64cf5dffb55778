"""The catalog: the models one server offers, each with its task, source and defaults
(config.py). Serving them on demand under a memory budget is built on top of it."""
