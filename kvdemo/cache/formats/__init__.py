"""One folder per KV cache format, each holding everything kvdemo knows of it: its card in `__init__.py` (`BACKEND`, a
`kvdemo.cache.backend.Backend`: options and their words, presets, byte formula, layout rules, cache factory, deploy
rule, store types, examples) and beside it its layers, blocks and codes. `kvdemo.cache.registry.FORMATS` lists the
folders, in the order the page shows them.

A folder's modules import each other relatively (`from .layers import ...`) and the shared rooms absolutely; no module
outside a folder and `kvdemo.cache.registry` imports it or names its format (`tests/test_registry.py`), so a copy of a
folder under another name, added to `registry.FORMATS`, is another format (`tests/test_format_folder.py`). No torch at
import: a card imports its layers in the function that builds a cache.
"""
