"""The HTTP front end: a Flask app factory, run by gunicorn with gevent workers."""
from __future__ import annotations

import logging

from flask import Flask

from dispatcher import config


def create_app(test_config: dict | None = None) -> Flask:
    """Defaults, then COMPLETIONS_* environment variables, then `test_config`."""
    app = Flask(__name__)
    app.config.from_mapping(
        DISPATCHER=None,
        MAX_BODY=config.OPTIONS["max_body"].default,
        MAX_PROMPT_CHARS=config.OPTIONS["max_prompt_chars"].default,
        API_KEY="",
        API_KEY_FILE=None,
    )
    app.config.from_prefixed_env(config.ENV_PREFIX.rstrip("_"))
    if test_config:
        app.config.update(test_config)
    if not app.config["DISPATCHER"]:
        raise RuntimeError(f"set {config.ENV_PREFIX}DISPATCHER to the dispatcher's address")
    app.config["MAX_CONTENT_LENGTH"] = int(app.config["MAX_BODY"])
    app.json.sort_keys = False
    app.json.ensure_ascii = False

    from app import auth, completions, errors, openapi, status, tokens
    errors.register_error_handlers(app)
    auth.init_app(app)
    for module in (completions, status, tokens, openapi):
        app.register_blueprint(module.bp)
    logging.getLogger("app").setLevel(logging.INFO)
    return app
