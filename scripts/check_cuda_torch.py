"""`make install-cuda`'s first check: this Python's torch is a CUDA build that sees a GPU
(installed for the card beforehand; pagedllm never pulls a torch build itself)."""
import sys

try:
    import torch
except ImportError:
    sys.exit("install-cuda: this Python has no torch; install torch for the card first "
             "(its CUDA build), then make install-cuda")
if not torch.cuda.is_available():
    where = ("a CPU-only build" if torch.version.cuda is None
             else f"built for CUDA {torch.version.cuda}")
    sys.exit(f"install-cuda: this Python's torch {torch.__version__} ({where}) sees no CUDA "
             f"GPU; install torch for the card first, or use make install on a CPU machine")
print(f"torch {torch.__version__} sees {torch.cuda.get_device_name(0)}")
