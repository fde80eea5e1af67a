"""One module per KV cache backend, each holding everything kvdemo knows of it: its options and their words, its
presets, its byte formula and layout rules, how its cache is built and which engine deploys it (`BACKEND`, a
`kvdemo.cache.backend.Backend`). `kvdemo.cache.registry.BACKENDS` lists the modules; no other module names a backend
(`tests/test_registry.py`). No torch at import: the modules that build a cache are imported by the function that
builds one.
"""
