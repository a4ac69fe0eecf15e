"""A WSGI app for the front-end worker's stop tests: /slow streams ten chunks 0.1 s apart,
anything else answers at once."""
import gevent


def app(environ, start_response):
    if environ["PATH_INFO"] == "/slow":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return _slow()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


def _slow():
    for i in range(10):
        gevent.sleep(0.1)
        yield b"chunk %d\n" % i
