"""The HTTP front end: a Flask app factory, run by gunicorn with gevent workers."""
from __future__ import annotations

import time

import gevent
from flask import Flask, request

from app.writes import bound_the_writes
from dispatcher.common import config, configfile, curve, protocol as P


def create_app(test_config: dict | None = None) -> Flask:
    """Defaults, then the config file (COMPLETIONS_CONFIG), then COMPLETIONS_* variables,
    then `test_config`."""
    app = Flask(__name__)
    options = configfile.effective(["dispatcher", "max_body", "max_prompt_chars",
                                    "api_key", "api_key_file", "cors_origin", "access_log",
                                    "body_timeout", "send_timeout", "heartbeat_interval", "cache_scope",
                                    "curve_keys", "curve_name", "insecure_transport",
                                    "any_model_name", "usage_by_key", "log_format",
                                    "status_access", "operator_key"])
    app.config.from_mapping(
        DISPATCHER=options["dispatcher"],
        MAX_BODY=options["max_body"],
        MAX_PROMPT_CHARS=options["max_prompt_chars"],
        API_KEY=",".join(options["api_key"]),
        API_KEY_FILE=options["api_key_file"],
        CORS_ORIGINS=options["cors_origin"],
        ACCESS_LOG=options["access_log"],
        BODY_TIMEOUT=options["body_timeout"],
        SEND_TIMEOUT=options["send_timeout"],
        HEARTBEAT_INTERVAL=options["heartbeat_interval"],
        CACHE_SCOPE=options["cache_scope"],
        CURVE_KEYS=options["curve_keys"],
        CURVE_NAME=options["curve_name"],
        INSECURE_TRANSPORT=options["insecure_transport"],
        ANY_MODEL_NAME=options["any_model_name"],
        USAGE_BY_KEY=options["usage_by_key"],
        LOG_FORMAT=options["log_format"],
        STATUS_ACCESS=options["status_access"],
        OPERATOR_KEYS=list(options["operator_key"]),
    )
    if test_config:
        app.config.update(test_config)
    _check_dispatcher(app.config)
    app.config["MAX_CONTENT_LENGTH"] = int(app.config["MAX_BODY"])
    from app.bodies import close_after
    app.wsgi_app = close_after(app.wsgi_app)
    app.json.sort_keys = False
    app.json.ensure_ascii = False

    from app import (access, auth, completions, cors, errors, fim, metrics, native, openapi,
                     status, tokens)
    errors.register_error_handlers(app)

    @app.before_request
    def stamp_arrival():
        # the client's order of a session's requests (superseding) is their arrival: as
        # the front end's gunicorn worker stamped it (app.gunicorn_worker), else now
        request.environ["completions.arrived_ns"] = getattr(
            gevent.getcurrent(), "completions_arrived_ns", None) or time.time_ns()

    app.after_request(bound_the_writes)
    # a big body's decoding slot, where the request ended before its validation did,
    # and its share of the bytes of big bodies held at once
    from app import bodies

    @app.teardown_request
    def give_back_body(exc):
        bodies.big_body_slots.give_back()
        bodies.body_bytes.give_back()

    @app.after_request
    def name_the_request(response):
        # every answer names its request (the openai packages read it into the error they
        # raise); one refused before it had an id gets one now, in the access log too
        if "X-Request-Id" not in response.headers:
            record = access.current()
            record["request_id"] = record.get("request_id") or P.new_request_id()
            response.headers["X-Request-Id"] = record["request_id"]
        return response

    access.init_app(app)               # first: a request refused below is logged too
    cors.init_app(app)                 # before auth: a preflight carries no credentials
    auth.init_app(app)
    metrics.init_app(app)
    for module in (completions, fim, native, status, tokens, openapi, metrics):
        app.register_blueprint(module.bp)
    return app


def _check_dispatcher(settings) -> None:
    """The dispatcher's address is set, and keyed where it must be: beyond loopback, and
    with API keys on loopback too (another local user's process on that port would be
    sent every key's prompts; the dispatcher refuses it so)."""
    if not settings["DISPATCHER"]:
        raise RuntimeError(f"set {config.ENV_PREFIX}DISPATCHER to the dispatcher's address")
    problem = curve.transport_problem(settings["DISPATCHER"], settings["CURVE_KEYS"],
                                      settings["INSECURE_TRANSPORT"],
                                      tenants=bool(settings.get("API_KEY") or
                                                   settings.get("API_KEY_FILE")))
    if problem:
        raise RuntimeError(problem)
