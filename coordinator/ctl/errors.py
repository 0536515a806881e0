"""The one error type commands raise: a one-line message and the exit code (the operator contract:
1 the operation or job failed, 2 bad usage or bad input)."""


class CtlError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
