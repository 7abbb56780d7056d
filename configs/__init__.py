"""The shipped experiment configs, one Python file each (``get_config(arg=None)``).

Give one to a command as ``--config=configs/<file>.py`` or ``--config=configs/<file>.py:<variant>``
(``:tiny`` is the smoke-run variant where a file names it in ``VARIANTS``), then change any key with
``--config.KEY=VALUE``. This folder is the package ``configs``, installed beside ``longctx``, so the
paths work from any working directory; see :mod:`longctx.config_files`. Configs start from one
another by import: ``from configs import default``.
"""
