"""The shared base every experiment config starts from.

Experiment files import it as ``from longctx.config import base_config`` and state only what
differs; the keys and their meaning are documented in longctx/config.py.
"""

from longctx.config import base_config


def get_config():
    return base_config()
