"""The `name==version` pins of the named distributions as this venv has them (those it
lacks left out), for `make gpu-wheels`."""
import importlib.metadata
import sys

pins = []
for name in sys.argv[1:]:
    try:
        pins.append(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        pass
print(" ".join(pins))
