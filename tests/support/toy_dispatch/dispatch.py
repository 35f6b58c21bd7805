"""A backend registry in the shape of FLA's fla.ops.backends (written for this test)."""
import os


class BackendRegistry:
    _registries = {}

    def __init__(self, operation):
        self._backends, self._logged = {}, set()
        BackendRegistry._registries[operation] = self

    def register(self, backend):
        self._backends[backend.backend_type] = backend


def dispatch(operation):
    def decorator(func):
        def wrapper(*args, **kwargs):
            registry = BackendRegistry._registries.get(operation)
            for be in (registry._backends.values() if registry else ()):
                if be.env_var and os.environ.get(be.env_var, "1") == "0":
                    continue
                key = f"{operation}:{func.__name__}:{be.backend_type}"
                if not be.verify(*args, **kwargs):
                    registry._logged.add(key + ":fail")
                    continue
                registry._logged.add(key)
                return getattr(be, func.__name__)(*args, **kwargs)
            return func(*args, **kwargs)
        return wrapper
    return decorator
