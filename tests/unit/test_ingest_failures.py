"""Which failed requests free their Idempotency-Key (nothing of them was published) and which keep it
bound to their send ids (they may have been published: the retry must publish the same ids)."""

import asyncio

import pytest
from fastapi import HTTPException

from streams.errors import PublishError, PublishOutcomeUnknown, StoreUnavailable
from streams.ingest.api import published_nothing


@pytest.mark.parametrize("failure", [
    HTTPException(422, "invalid"), HTTPException(429, "over quota"),
    StoreUnavailable("redis down"), PublishError("the batch was not published (nothing of it was)"),
])
def test_a_request_refused_or_aborted_whole_frees_its_key(failure):
    assert published_nothing(failure)


@pytest.mark.parametrize("failure", [
    PublishOutcomeUnknown("the commit did not finish and could not be aborted"),
    asyncio.CancelledError(), RuntimeError("a bug met while publishing"),
])
def test_a_request_that_may_have_been_published_keeps_its_key(failure):
    assert not published_nothing(failure)
