"""The one error shape for a request field that cannot be used: `param` names the field (as
the API's error JSON does), the message says why. Plain Python: the core raises it too."""
from __future__ import annotations


class FieldError(ValueError):
    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(f"{param}: {message}")
