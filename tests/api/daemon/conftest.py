"""The API through a real ``localai serve`` (and, in clients/, real client libraries against one): each test gets its
own home, as everywhere in the suite (tests/conftest.py), not the module-shared home of the in-process tier in the
folder above (tests/api/conftest.py overrides it for the tests beside it)."""

from tests.conftest import isolated_home

__all__ = ["isolated_home"]
