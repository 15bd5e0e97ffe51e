"""The backends and routes a build can take (pipeline.routes.route): the one place that knows their names."""

from pipeline.routes.route import (BACKEND_NAMES, BACKENDS, ENGINE, LLMAPI, PORTABLE, PORTABLE_BACKEND, ROUTE_CHOICES,
                                   ROUTES, TRTLLM_BACKEND, Backend, Route, backend_named, pick_route, route_named)

__all__ = ["BACKEND_NAMES", "BACKENDS", "ENGINE", "LLMAPI", "PORTABLE", "PORTABLE_BACKEND", "ROUTE_CHOICES", "ROUTES",
           "TRTLLM_BACKEND", "Backend", "Route", "backend_named", "pick_route", "route_named"]
