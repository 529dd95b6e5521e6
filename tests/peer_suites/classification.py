"""Known peer-suite failures: which class each belongs to and why.

``classify(suite, nodeid, message)`` walks ``RULES`` in order; the first rule whose test-id
pattern (and message pattern, when given) matches names the cause. A failure no rule matches is
"unclassified": new, and worth a look. The causes are explained in ``README.md`` beside this
file, with the request, what the gateway answered and what OpenAI's API answers.

Classes: ``protocol`` (the gateway answers what OpenAI's API would not), ``model`` (the tiny
model's content: it only learnt a weather tool-call format), ``peer`` (a vLLM/SGLang-only
extension, route, wording or server option; or an API other than chat completions).
"""

from __future__ import annotations

import re

CAUSES: dict[str, tuple[str, str]] = {
    # -- protocol ------------------------------------------------------------------------------
    "P1-final-chunk-duplicate-index": (
        "protocol",
        "the last content and the finish_reason of a choice come as two entries with the same "
        "index in one chunk; readers of choices[0] never see the finish_reason",
    ),
    "P2-response-format-json": (
        "protocol",
        "response_format json_object / json_schema rejected (400 \"Input should be 'text'\")",
    ),
    "P3-logit-bias": ("protocol", "logit_bias rejected as an unsupported field (400)"),
    "P4-penalties": (
        "protocol",
        "frequency_penalty / presence_penalty other than 0 rejected (400)",
    ),
    "P5-models-retrieve": ("protocol", "no GET /v1/models/{model} route (plain-text 404)"),
    "P6-seed-range": (
        "protocol",
        "a seed outside int64 reaches the engine: 502 engine_error (or 200), not a 400",
    ),
    "P7-tool-schema": (
        "protocol",
        "function parameters that are not a valid JSON Schema are accepted (200), not a 400",
    ),
    # -- model quality -------------------------------------------------------------------------
    "M1-tool-calls": (
        "model",
        "the tiny model makes no call for tools it never learnt (tool_choice auto), or makes "
        "valid calls with other arguments than the test expects (required/named calls are "
        "grammar-constrained: always well-formed, never the peer model's answer)",
    ),
    "M4-json-content": (
        "model",
        "response_format JSON: the output is valid JSON (valid against the schema), by "
        "constrained decoding; its content is the tiny model's, not the answer the test expects",
    ),
    "M2-content": ("model", "content assertions (arithmetic, distinct samples of a peaked model)"),
    "M3-token-counts": ("model", "prompt_tokens expected for the peer's model and tokenizer"),
    # -- peer-specific -------------------------------------------------------------------------
    "X18-not-json-schema": (
        "peer",
        'the test\'s tool says "type": "int", which is not JSON Schema: OpenAI answers 400, '
        "as corral does; SGLang accepts it",
    ),
    "X1-vllm-structured-outputs": ("peer", "vLLM's structured_outputs extra_body"),
    "X2-vllm-prompt-logprobs": ("peer", "vLLM's prompt_logprobs request field and response field"),
    "X3-vllm-echo-continue": (
        "peer",
        "vLLM's echo / continue_final_message / add_generation_prompt extra_body",
    ),
    "X4-vllm-top-logprobs-all": ("peer", "vLLM's top_logprobs=-1 (whole vocabulary)"),
    "X5-vllm-token-ids": ("peer", "vLLM's return_token_ids / truncate_prompt_tokens"),
    "X6-vllm-invocations": ("peer", "vLLM's SageMaker route POST /invocations"),
    "X7-vllm-continuous-usage": ("peer", "vLLM's stream_options.continuous_usage_stats"),
    "X8-lenient-messages": (
        "peer",
        "vLLM accepts unknown message keys and custom roles; OpenAI answers 400 as corral does",
    ),
    "X9-vllm-reasoning-field": ("peer", "vLLM's message.reasoning (not an OpenAI field)"),
    "X10-sglang-reasoning-attr": (
        "peer",
        "reads delta.reasoning_content, which OpenAI's SDK type lacks unless the server sends it",
    ),
    "X11-completions-api": ("peer", "legacy text Completions API /v1/completions (not chat)"),
    "X12-responses-api": ("peer", "Responses API /v1/responses (not chat completions)"),
    "X13-sglang-extensions": (
        "peer",
        "SGLang's regex / continue_final_message / custom_logit_processor / rerank / score",
    ),
    "X14-error-wording": ("peer", "a 400 is answered; the test wants SGLang's exact wording"),
    "X15-sglang-defs-limit": (
        "peer",
        "SGLang's own limit (conflicting $defs under tool_choice required); OpenAI accepts them",
    ),
    "X17-vllm-last-chunk-content": (
        "peer",
        "vLLM wants the last content in the finish chunk; OpenAI ends with an empty delta",
    ),
    "X16-server-options": (
        "peer",
        "server launch options the shim cannot pass (--max-payload-size 1024, pythonic parser)",
    ),
}

V, S = "vllm", "sglang"
RULES: list[tuple[str, str, str, str]] = [
    # (suite, test-id pattern, message pattern or "", cause)
    (V, r"::test_chat_streaming\[", r"assert 0 == 1", "P1-final-chunk-duplicate-index"),
    (V, r"::test_chat_streaming\[", r"ChoiceDelta\(.*\)\.content", "X17-vllm-last-chunk-content"),
    (
        V,
        r"::test_response_format_json_(object|schema)\b",
        r"Input should be 'text'",
        "P2-response-format-json",
    ),
    (V, r"::test_response_format_json_(object|schema)\b", r"AssertionError", "M4-json-content"),
    (V, r"::test_chat_logit_bias_", r"logit_bias", "P3-logit-bias"),
    (S, r"::test_function_calling_format\b", r"not a valid JSON Schema", "X18-not-json-schema"),
    (V, r"::test_long_seed\b", r"502|engine", "P6-seed-range"),
    (V, r"::test_structured_outputs_", "", "X1-vllm-structured-outputs"),
    (V, r"::test_(more_than_one_)?prompt_logprobs", "", "X2-vllm-prompt-logprobs"),
    (V, r"::test_chat_session_with_echo_and_continue_final_message", "", "X3-vllm-echo-continue"),
    (V, r"::test_top_logprobs\b", "", "X4-vllm-top-logprobs-all"),
    (V, r"::test_chat_completion_truncation_side", "", "X5-vllm-token-ids"),
    (V, r"::test_invocations\b", "", "X6-vllm-invocations"),
    (
        V,
        r"::test_chat_completion_stream_options",
        r"continuous_usage_stats",
        "X7-vllm-continuous-usage",
    ),
    (V, r"::test_(extra_fields_allowed|custom_role)\b", r"400", "X8-lenient-messages"),
    (V, r"::test_function_tool_use\[True-", r"attribute 'reasoning'", "X9-vllm-reasoning-field"),
    (V, r"::test_(function_tool_use|named_tool_use)\b", "", "M1-tool-calls"),
    (
        V,
        r"::test_(complex_message_content|chat_completion_n_parameter_non_streaming)",
        "",
        "M2-content",
    ),
    (V, r"::test_single_chat_session\[", "", "M3-token-counts"),
    (
        S,
        r"TestOpenAIServer::test_chat_completion_stream$",
        r"reasoning_content",
        "X10-sglang-reasoning-attr",
    ),
    (S, r"TestOpenAIServer::test_completion(_stream)?$", r"404", "X11-completions-api"),
    (S, r"TestOpenAIServerv1Responses::test_(response\w*|error|penalty)$", "", "X12-responses-api"),
    (S, r"TestOpenAIServer::test_penalty$", r"penalty", "P4-penalties"),
    (S, r"::test_retrieve_model$", r"404", "P5-models-retrieve"),
    (S, r"::test_(regex|response_prefill)$", r"400", "X13-sglang-extensions"),
    (S, r"TestOpenAIServerCustomLogitProcessor::", "", "X13-sglang-extensions"),
    (S, r"TestOpenAIV1(Rerank|Score)::", "", "X13-sglang-extensions"),
    (S, r"::test_invalid_json_schema_in_tool$", r"BadRequestError not raised", "P7-tool-schema"),
    (S, r"::test_error_handling_invalid_tool_choice$", r"400", "X14-error-wording"),
    (S, r"::test_conflicting_defs_required_tool_choice$", "", "X15-sglang-defs-limit"),
    (S, r"TestRequestBodyValidation::", "", "X16-server-options"),
    (S, r"TestOpenAIPythonicFunctionCalling::", "", "X16-server-options"),
    (S, r"Test(OpenAIServerFunctionCalling|ToolChoice\w+|ParallelToolCall)::", "", "M1-tool-calls"),
]


def classify(suite: str, nodeid: str, message: str) -> tuple[str, str]:
    for rule_suite, test_pattern, message_pattern, cause in RULES:
        if rule_suite != suite or not re.search(test_pattern, nodeid):
            continue
        if message_pattern and not re.search(message_pattern, message):
            continue
        return CAUSES[cause][0], cause
    return "unclassified", "unknown"
