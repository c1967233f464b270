"""Version checks for patch targets: a patch written for a range of a framework's releases says
so clearly instead of failing somewhere inside the framework."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version


class UnsupportedVersion(RuntimeError):
    """The installed framework version is outside the range a patch was written for."""


def installed_version(package: str) -> Version | None:
    """Version of an installed distribution, or None when it is not installed."""
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def require_version(package: str, minimum: str, below: str | None = None, *, version_module: str | None = None) -> Version:
    """Raise UnsupportedVersion unless ``minimum <= version(package) < below``.

    ``version_module``: a module whose ``__version__`` gives the version when ``package`` has no
    distribution metadata (a source checkout on ``PYTHONPATH``, e.g. Megatron-LM's
    ``megatron.core.package_info``)."""
    version = installed_version(package)
    if version is None and version_module is not None:
        import importlib

        try:
            version = Version(importlib.import_module(version_module).__version__)
        except (ImportError, AttributeError):
            version = None
    if version is None:
        raise UnsupportedVersion(f"dsa_plugins needs {package} >= {minimum}, which is not installed")
    if version < Version(minimum) or (below is not None and version >= Version(below)):
        upper = f" and < {below}" if below else ""
        raise UnsupportedVersion(
            f"dsa_plugins patches for {package} support versions >= {minimum}{upper}; found {version}"
        )
    return version
