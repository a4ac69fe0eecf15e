# gunicorn config for a front end run on its own (systemd, or by hand):
#   COMPLETIONS_DISPATCHER=tcp://127.0.0.1:5550 gunicorn -c deploy/gunicorn.conf.py
# Every setting comes from COMPLETIONS_* variables; see app/gunicorn_conf.py.
from app.gunicorn_conf import *  # noqa: F401,F403
