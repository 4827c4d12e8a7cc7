"""The shipped configs (data, no code): ``deepspeed/``, ``train/``, ``serve/`` and ``trees/``. The checkout's top-level
``configs/`` folder installs as the package ``medusa_lite.configs``, by the same package-dir mapping as ``train/`` and
``serve/``; :data:`medusa_lite.paths.CONFIGS_DIR` finds it either way."""
