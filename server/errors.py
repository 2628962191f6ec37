"""OpenAI's error body, and strict request decoding that turns every client mistake into a 4xx."""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from starlette.responses import Response

from jaxllm.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_TIMEOUT: "RequestTimeoutError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}

_ENCODER = msgspec.json.Encoder()
# What a client hears of a failure that is not its fault; the cause goes to the log only.
INTERNAL_ERROR = "Internal server error; the server log has the details."


class OpenAIError(Exception):
    """Raised anywhere in a handler; the app turns it into OpenAI's error body."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status, "BadRequestError")
    return ErrorResponse(ErrorInfo(message=message, type=error_type, param=param, code=int(status)))


def error_response(error: OpenAIError) -> Response:
    body = _ENCODER.encode(error_body(error.message, error.status, error.param))
    return Response(body, status_code=int(error.status), media_type="application/json")


def decode_request[T](body: bytes, request_type: type[T]) -> T:
    """Decodes a JSON body into `request_type`, strict on types; unknown fields are logged.
    The body is decoded twice (the second time for the unknown fields' names, which the typed
    decode skips without checking their UTF-8), so both decodes are guarded."""
    try:
        request = msgspec.json.decode(body, type=request_type)
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as error:
        raise OpenAIError(f"Invalid request: {error}", param=_error_path(str(error))) from None
    except msgspec.DecodeError as error:
        raise OpenAIError(f"Malformed JSON body: {error}") from None
    except RecursionError:  # msgspec bounds the nesting by the interpreter's recursion limit
        raise OpenAIError("Malformed JSON body: nested too deeply.") from None
    unknown = sorted(set(fields) - set(request_type.__struct_fields__))
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       [name[:64] for name in unknown[:16]])
    return request


def _error_path(message: str) -> str | None:
    # msgspec ends its messages with " - at `$.field...`"
    _, sep, path = message.rpartition(" - at `$.")
    return path.rstrip("`") if sep else None
