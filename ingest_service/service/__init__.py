"""The aiohttp service: app, config, supervisor, auth, routes, admin and runs API, OpenAPI, dashboard."""
