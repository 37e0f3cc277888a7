"""The ingress's FastAPI app: its OpenAPI document, OpenAI's error body for every failure, and the
narrowing of the published schema to what one deployment serves.

Errors always take OpenAI's body ({"error": {message, type, param, code}}) with the right status:
400 invalid parameters (never FastAPI's 422), 401 bad key, 404 unknown model, 408 timeout,
413 body too large, 503 overloaded or no target.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import APIError, invalid
from app.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from app.openai.tokenization import DetokenizeRequest, TokenizeCompletionRequest

log = logging.getLogger("ray.serve")

api = FastAPI(title="specserve", description="Exact speculative decoding, OpenAI-compatible.")
# the bodies each POST endpoint reads (/tokenize also takes TokenizeChatRequest: `messages` for `prompt`)
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeCompletionRequest, "/detokenize": DetokenizeRequest}


def _openapi() -> dict:
    """FastAPI's OpenAPI document with the request bodies the endpoints read. They parse bodies
    themselves (nulls, allowlisted fields, 400 rather than FastAPI's 422), so FastAPI cannot see them;
    clients, docs and schema fuzzers need them."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        error = {"description": "OpenAI's error body", "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            operation["responses"].update({str(code): error for code in (400, 401, 404, 408, 413, 503)})
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi


def narrow_schema(model_name: str, max_tokens_cap: int) -> None:
    """This deployment's limits in the published schema: the one model it serves, its max_tokens cap."""
    components = _openapi()["components"]["schemas"]
    for model in BODIES.values():
        fields = components[model.__name__]["properties"]
        fields["model"] = {**fields["model"], "enum": [model_name]}
        for name in ("max_tokens", "max_completion_tokens"):
            if name in fields:
                fields[name] = {**fields[name], "anyOf": [{"type": "integer", "minimum": 1, "maximum": max_tokens_cap},
                                                          {"type": "null"}]}


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "integer", "null"]}}}}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, e.headers)


@api.exception_handler(APIError)
async def _api_error(_, exc: APIError):
    return error_response(exc)


@api.exception_handler(RequestValidationError)
async def _validation_error(_, exc: RequestValidationError):
    return error_response(invalid(exc.errors()))


@api.exception_handler(StarletteHTTPException)
async def _http_error(_, exc: StarletteHTTPException):
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    return JSONResponse(error_body(str(exc.detail), kinds.get(exc.status_code, "invalid_request_error")),
                        exc.status_code)


@api.exception_handler(Exception)
async def _internal(request: Request, exc: Exception):
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error", code=500), 500)
