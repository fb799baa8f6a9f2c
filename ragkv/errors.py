"""User-facing errors. The CLI prints their message on one line and exits with code 2."""


class RagkvError(Exception):
    """Base class for errors caused by input or configuration; the message says what to do."""


class ModelNotFoundError(RagkvError):
    pass


class UnsupportedModelError(RagkvError):
    pass


class PromptTooLongError(RagkvError):
    def __init__(self, tokens: int, limit: int, what: str = "prompt"):
        self.tokens, self.limit = tokens, limit
        super().__init__(
            f"{what} is {tokens} tokens but the model accepts at most {limit} positions; "
            "shorten it or pass fewer/shorter passages"
        )


class InvalidRequestError(RagkvError):
    pass


class OptionError(InvalidRequestError):
    """A declared option (FusionOptions, GenerationOptions) out of its bounds; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
