"""Environments that run inside sandboxes (each module imports only what it needs, so
importing this package costs nothing): ``tictactoe`` (pure Python, no dependencies);
``multiagent`` (one sandbox per agent program, a referee on the host; the SDK only);
``codegen`` (write, run and submit code in one sandbox per episode; the SDK only)."""
