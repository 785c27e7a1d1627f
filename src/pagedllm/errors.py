"""The errors every layer shares. Plain Python: the core raises them too.

FieldError is the one shape for a request field that cannot be used: `param` names the field
(as the API's error JSON does), `code` says what kind of problem it is, the message says why.
The server turns every FieldError into a 400 in the shape of the API that was called, in one
handler (server/errors.py): no route translates them by hand."""
from __future__ import annotations


class FieldError(ValueError):
    code = "invalid_value"

    def __init__(self, param: str | None, message: str, code: str | None = None):
        self.param = param
        if code is not None:
            self.code = code
        super().__init__(f"{param}: {message}" if param else message)


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message names the file and the problem."""

    def __init__(self, path: str, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"cannot load model from {self.path}: {problem}")


class EngineDeadError(RuntimeError):
    """The engine (or the replica) serving a request failed while running it."""


class EngineUnavailableError(EngineDeadError):
    """No engine takes requests at this instant (the engine process just died and is being
    restarted): the request was not submitted; the server answers 503, as while restarting."""


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served over this model, in one line naming why
    (lora/: a bad file, another model's adapter, an option it cannot honour)."""
