"""What the front ends (app/), the workers (workers/) and the dispatcher share: the wire
contract (`protocol`), the settings (`config`, `configfile`), devices, model resolution,
the request fields, the route fit, the grammar checker and process helpers. app/ and
workers/ import from the dispatcher package only from here; nothing here imports the
broker, the tools, app/ or workers/."""
