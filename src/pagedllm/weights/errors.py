class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message names the file and the problem."""

    def __init__(self, path: str, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"cannot load model from {self.path}: {problem}")
