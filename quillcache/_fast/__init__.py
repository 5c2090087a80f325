"""Compiled and jitted hot paths. Import the public wrappers (``quillcache.alloc`` etc.), not these."""
