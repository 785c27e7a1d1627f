"""The docs' request-field table (docs/apis.md) and the request models the server publishes agree: every
field a generation route accepts is listed for that API as honoured, no effect or refused
(a field in no row is refused by the model itself: extra="forbid")."""
import os
import re

import pytest

from pagedllm.server.anthropic_protocol import MessagesRequest
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.responses_protocol import ResponsesRequest

FIELD_TABLE = os.path.join(os.path.dirname(__file__), "..", "docs", "apis.md")
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest,
          "messages": MessagesRequest, "responses": ResponsesRequest}
ROW = re.compile(r"^\| `(\w+)` \| ([a-z, ]+) \| (honoured|no effect|refused)")


def table() -> dict[tuple[str, str], str]:
    rows = {}
    with open(FIELD_TABLE) as f:
        for line in f:
            match = ROW.match(line)
            if match:
                field, apis, treatment = match.groups()
                for api in apis.split(", "):
                    assert (api, field) not in rows, f"{field} listed twice for {api}"
                    rows[(api, field)] = treatment
    return rows


@pytest.mark.parametrize("api", MODELS)
def test_every_accepted_field_is_in_the_table_and_nothing_else(api):
    rows = table()
    published = set(MODELS[api].model_json_schema(by_alias=True)["properties"])
    listed = {field for (row_api, field) in rows if row_api == api}
    assert published - listed == set(), f"{api}: fields missing from the docs' table"
    assert listed - published == set(), f"{api}: the docs' table lists fields the API does not take"


@pytest.mark.parametrize("api", MODELS)
def test_unlisted_fields_are_refused_by_the_model(api):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        MODELS[api].model_validate({"surely_not_a_field": 1})
    assert any(e["type"] == "extra_forbidden" for e in caught.value.errors())
