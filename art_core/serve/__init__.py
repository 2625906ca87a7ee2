"""`art serve`: the backend as an HTTP server (app, model and job routes, guard, errors, idle
exit) for `RemoteBackend` clients."""
