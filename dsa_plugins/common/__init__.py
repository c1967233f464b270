"""The ground floor every layer may import: kernels, reference, ops, adapters and the CLI.

- :mod:`.settings`: environment settings (backend, index checks, determinism, autoload) and the
  one-time warning;
- :mod:`.indices`: the index convention (int32, -1 or out of range = no key) as code;
- :mod:`.validation`: input checks whose errors name the tensor and what was expected.

These modules import torch and the standard library only, never another part of dsa_plugins.
"""
