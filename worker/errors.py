"""OpenAI-format errors live in `common.errors` (shared with the router)."""

from common.errors import APIError, error_body, install_error_handlers

__all__ = ["APIError", "error_body", "install_error_handlers"]
