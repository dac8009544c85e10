"""HTTP routes of the backend: the user API, the worker API and the OpenAPI document."""
