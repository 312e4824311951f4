"""Which failed requests free their Idempotency-Key (nothing of them was published) and which keep it
bound to their send ids (they may have been published: the retry must publish the same ids), and
which delivery errors leave a record possibly written."""

import asyncio

import pytest
from confluent_kafka import KafkaError
from fastapi import HTTPException

from streams.errors import PublishError, PublishOutcomeUnknown, StoreUnavailable
from streams.ingest.api import published_nothing
from streams.kafka_client import may_be_written


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


@pytest.mark.parametrize("code", [
    KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT, KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, KafkaError.UNKNOWN_PRODUCER_ID, KafkaError._PURGE_INFLIGHT,
    KafkaError._FATAL,
])
def test_a_delivery_error_after_which_the_broker_may_have_written_the_record_is_an_unknown_outcome(code):
    assert may_be_written(KafkaError(code))


@pytest.mark.parametrize("code", [
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError._UNKNOWN_TOPIC,
    KafkaError._PURGE_QUEUE, KafkaError._TIMED_OUT_QUEUE,
])
def test_a_refusal_or_a_record_that_never_left_the_client_is_not_written(code):
    assert not may_be_written(KafkaError(code))
