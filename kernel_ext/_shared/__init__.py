"""Private mechanisms the worker side and the relay side share, each with its rule once.

Modules:

* :mod:`kernel_ext._shared.backoff` — the one retry schedule (jittered exponential backoff);
* :mod:`kernel_ext._shared.bounded` — the one bounded memory (``BoundedMap``);
* :mod:`kernel_ext._shared.compat` — every use of another library's private names, probed
  once at import;
* :mod:`kernel_ext._shared.lazy` — the PEP 562 ``__getattr__`` of packages that import names
  on first use.

Importing this package imports none of them.
"""
