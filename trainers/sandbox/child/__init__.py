"""Code that runs inside the sandbox. The launcher copies ``boot.py``, ``guard.py`` and
``plain.py`` into the program's read-only root (``/.gradscope``); the caller imports them only
for their constants and for the tests."""
