"""The test session's own fastml cache: FASTML_CACHE points at a temporary directory for the whole session, and the
`fastml` subprocesses the tests start inherit it, so the suite never reads or writes the user's cache
(~/.cache/fastml: this CPU's measured profile, the default corpus, the built C++ ops). The first test that plans on
this CPU measures it, once for the session (a few seconds); tests that fake the measurements set their own
FASTML_CACHE under tmp_path."""

import os
import shutil
import tempfile


def pytest_configure(config):
    config.fastml_cache = tempfile.mkdtemp(prefix="fastml-test-cache-")
    os.environ["FASTML_CACHE"] = config.fastml_cache


def pytest_unconfigure(config):
    shutil.rmtree(config.fastml_cache, ignore_errors=True)
