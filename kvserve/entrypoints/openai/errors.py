"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as code.

Handlers raise `OpenAIError` subclasses; the app's exception handlers turn them (and FastAPI's own
validation and routing errors) into that body. `type` follows vLLM's server ("BadRequestError",
"NotFoundError", ...), which the official `openai` client maps to its exception classes by status code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    status_code = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_response(self) -> JSONResponse:
        return error_response(self.status_code, self.message, self.error_type, self.param)

    def to_body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.error_type, self.param)


class InternalServerError(OpenAIError):
    """A failure of the server itself (a bug), not of the request."""


class BadRequestError(OpenAIError):
    status_code = 400
    error_type = "BadRequestError"


class AuthenticationError(OpenAIError):
    status_code = 401
    error_type = "AuthenticationError"


class NotFoundError(OpenAIError):
    status_code = 404
    error_type = "NotFoundError"


class PayloadTooLargeError(OpenAIError):
    status_code = 413
    error_type = "PayloadTooLargeError"


class ServiceUnavailableError(OpenAIError):
    status_code = 503
    error_type = "ServiceUnavailableError"


_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "BadRequestError",
    503: "ServiceUnavailableError",
}


def error_type_for(status_code: int) -> str:
    return _TYPE_BY_STATUS.get(status_code, "InternalServerError" if status_code >= 500 else "BadRequestError")


def error_body(status_code: int, message: str, error_type: str | None = None, param: str | None = None
               ) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type or error_type_for(status_code),
            "param": param,
            "code": status_code,
        }
    }


class EchoingJSONResponse(JSONResponse):
    """A body as JSONResponse writes one (compact, UTF-8), except that when it quotes a request value UTF-8
    cannot encode (a lone surrogate, which JSON's "\\ud800" escape reads as: an error's message, a Responses API
    response's instructions), the characters past ASCII are escaped instead of the answer failing."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status_code: int, message: str, error_type: str | None = None, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return EchoingJSONResponse(error_body(status_code, message, error_type, param), status_code=status_code,
                               headers=headers)
