"""``GET /openapi.json``: an OpenAPI 3.1 document built from the served operations.

Schemas come from the pydantic models (``corral.schema`` and
``corral.api.models``) through ``TypeAdapter.json_schemas``; paths come from the served
operations (:mod:`corral.api.operations`), so every route is listed, each with the
error codes it may answer (its statuses, and ``x-error-codes``).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import JsonSchemaMode
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral._version import __version__
from corral.api.models import ErrorResponse, StreamEvent
from corral.api.operations import COMMON_ERRORS
from corral.server.endpoint import NDJSON, RAW, TEXT, Endpoint

REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"{(\w+)}")


def _name(model: Any) -> str:
    return model.__name__


Key = tuple[str, JsonSchemaMode]  # (model name, "validation" for bodies / "serialization")


def _schemas(models: dict[Key, Any]) -> tuple[dict[Key, Any], dict[str, Any]]:
    """(key -> $ref, every definition for components.schemas)."""
    adapters = [(name, mode, TypeAdapter(model)) for (name, mode), model in models.items()]
    refs, top = TypeAdapter.json_schemas(adapters, ref_template=REF)
    return refs, top.get("$defs", {})


def _models(endpoints: tuple[Endpoint, ...]) -> dict[Key, Any]:
    found: dict[Key, Any] = {
        (_name(ErrorResponse), "serialization"): ErrorResponse,
        (_name(StreamEvent), "serialization"): StreamEvent,
    }
    for e in endpoints:
        for model, mode in ((e.op.body, "validation"), (e.op.reply, "serialization")):
            if isinstance(model, tuple):  # (media type, model of each line)
                model = model[1]
            if model is not None and not isinstance(model, str):
                found[(_name(model), mode)] = model
    return found


def _content(kind: Any, refs: dict[Key, Any], mode: JsonSchemaMode) -> dict[str, Any]:
    if isinstance(kind, tuple):  # a stream of JSON lines of a model other than StreamEvent
        return {kind[0]: {"schema": refs[(_name(kind[1]), mode)]}}
    if kind == RAW:
        return {RAW: {"schema": {"type": "string", "format": "binary"}}}
    if kind == TEXT:
        return {TEXT: {"schema": {"type": "string"}}}
    if kind == NDJSON:
        return {NDJSON: {"schema": refs[(_name(StreamEvent), "serialization")]}}
    return {"application/json": {"schema": refs[(_name(kind), mode)]}}


def _errors(e: Endpoint, refs: dict[Key, Any]) -> dict[str, Any]:
    """The error replies of ``e`` by status, each naming the codes it carries."""
    by_status: dict[int, set[str]] = {}
    for err in (*COMMON_ERRORS, *e.op.errors):
        by_status.setdefault(err.status, set()).add(err.code)
    content = _content(ErrorResponse, refs, "serialization")
    return {
        str(status): {
            "description": "error.code: " + ", ".join(sorted(codes)),
            "content": content,
            "x-error-codes": sorted(codes),
        }
        for status, codes in sorted(by_status.items())
    }


def _operation(endpoint: Endpoint, refs: dict[Key, Any]) -> dict[str, Any]:
    e = endpoint.op
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PATH_PARAM.findall(e.path)
    ]
    for q in e.query:
        schema: dict[str, Any] = {"type": q.type}
        if q.enum:
            schema["enum"] = list(q.enum)
        if q.min_length is not None:
            schema["minLength"] = q.min_length
        if q.repeat:
            schema = {"type": "array", "items": schema}
        params.append(
            {
                "name": q.name,
                "in": "query",
                "required": q.required,
                "description": q.description,
                "schema": schema,
                **({"explode": True} if q.repeat else {}),
            }
        )
    ok: dict[str, Any] = {"description": e.summary}
    if e.reply is not None:
        ok["content"] = _content(e.reply, refs, "serialization")
    op: dict[str, Any] = {
        "operationId": e.name,
        "summary": e.summary,
        "parameters": params,
        "responses": {
            str(e.status): ok,
            **_errors(endpoint, refs),
            "default": {
                "description": "an error (see corral.errors for the codes)",
                "content": _content(ErrorResponse, refs, "serialization"),
            },
        },
        "x-error-codes": list(e.codes()),
        "x-access": e.access.value,
        "x-routing": e.routing.value,
    }
    if e.body is not None:
        op["requestBody"] = {
            "required": e.body == RAW or (endpoint.takes_model and not e.body_optional),
            "content": _content(e.body, refs, "validation"),
        }
    return op


def openapi_document(endpoints: tuple[Endpoint, ...]) -> dict[str, Any]:
    """The OpenAPI 3.1 description of ``endpoints``."""
    refs, defs = _schemas(_models(endpoints))
    paths: dict[str, dict[str, Any]] = {}
    for e in endpoints:
        paths.setdefault(e.op.path, {})[e.op.method.lower()] = _operation(e, refs)
    paths["/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "responses": {
                "200": {
                    "description": "OpenAPI 3.1",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                }
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "corral",
            "version": __version__,
            "description": "Self-hosted sandboxes for reinforcement learning (docs/api.md).",
        },
        "paths": paths,
        "components": {
            "schemas": defs,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],  # none on the Unix socket, a token on TCP
    }


def openapi_route(endpoints: tuple[Endpoint, ...]) -> Route:
    """``GET /openapi.json`` for ``endpoints``."""
    document = openapi_document(endpoints)

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    return Route("/openapi.json", openapi, methods=["GET"])
