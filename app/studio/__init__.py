"""The studio's use cases: every rule about runs, datasets, models, exports and accounts.

Each surface (HTML pages, the native ``/api``, the OpenAI-style ``/v1``) calls these functions and
maps their :class:`~app.studio.errors.StudioError` to HTTP in one place. This package imports
``app.store``, ``app.data`` and ``app.settings``; never fastapi, starlette or jinja2.
"""
