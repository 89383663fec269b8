"""The op registry (`registry.py`) and the op families that fill it, one module each
(`families.py` lists them)."""
