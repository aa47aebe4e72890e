"""Tool calls through `rollout serve --tool-call-parser hermes`: parsing, streaming, tool_choice, and the
OpenAI client driving a tool-using conversation against a tiny model trained to call a tool."""

from __future__ import annotations

import json

import pytest
import torch
from support.chat_model import make_chat_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from rollout.serve.tools import ToolStream, forced_prefix, parse_tool_calls, tool_mode, tools_start_newline

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "The sum is 5."
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
USER = {"role": "user", "content": "add 2 and 3"}


def test_hermes_parsing_keeps_malformed_text_as_content():
    parsed = parse_tool_calls("hermes", "let me add " + CALL)
    assert parsed.content == "let me add"
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    two = parse_tool_calls("hermes", CALL + CALL.replace('"a": 2', '"a": 7'))
    assert len(two.tool_calls) == 2 and two.content is None
    for bad in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "plain text"):
        parsed = parse_tool_calls("hermes", bad)
        assert parsed.tool_calls == [] and parsed.content == bad


def test_tool_stream_holds_back_a_marker_and_sends_calls_last():
    stream = ToolStream("hermes")
    assert stream.delta("hello <tool", done=False) == ("hello ", None)  # NOTE: "<tool" may start a call
    assert stream.delta("hello <tool_call>{", done=False) == ("", None)
    content, calls = stream.delta("hello " + CALL, done=True)
    assert content == "" and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"
    plain = ToolStream("hermes")
    assert plain.delta("a <b", done=False) == ("a <b", None)
    assert plain.delta("a <b> <tool_call>oops", done=True) == ("> <tool_call>oops", None)  # NOTE: no call: all content


def test_tool_choice():
    assert tool_mode(TOOLS, None, "hermes") == "hermes" and tool_mode(None, None, "hermes") is None
    assert tool_mode(TOOLS, None, None) is None and tool_mode(TOOLS, "none", "hermes") is None
    named = {"type": "function", "function": {"name": "add"}}
    assert tool_mode(TOOLS, "required", "hermes") == "hermes" == tool_mode(TOOLS, named, "hermes")
    for choice, parser, tools, match in (
            ("auto", None, TOOLS, "--tool-call-parser"), ("sometimes", "hermes", TOOLS, "tool_choice must"),
            ("required", None, TOOLS, "--tool-call-parser"), ("required", "hermes", None, "needs tools"),
            ({"type": "function"}, "hermes", TOOLS, "function"),
            ({"type": "function", "function": {"name": "mul"}}, "hermes", TOOLS, "'mul', which is not among")):
        with pytest.raises(Exception, match=match) as err:
            tool_mode(tools, choice, parser)
        assert err.value.param == "tool_choice"
    # the forced openings: the start marker, or the call up to its arguments (newline as the template writes it)
    assert forced_prefix(TOOLS, "required", "hermes") == "<tool_call>" and forced_prefix(TOOLS, "auto", "hermes") == ""
    assert forced_prefix(TOOLS, named, "hermes") == '<tool_call>{"name": "add", "arguments": '
    assert forced_prefix(TOOLS, named, "hermes", newline=True) == '<tool_call>\n{"name": "add", "arguments": '
    assert tools_start_newline("{{ '<tool_call>\\n' + t }}", "hermes") and not tools_start_newline(None, "hermes")
    # streamed with a forced prefix: no content before the call, the call (prefix + the model's rest) at the end
    forced = ToolStream("hermes", "<tool_call>")
    assert forced.delta('{"name": "add", ', done=False) == ("", None)
    content, calls = forced.delta(CALL[len("<tool_call>"):], done=True)
    assert content == "" and calls[0]["function"]["name"] == "add"


def _conversations(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of the two turns the model must learn: call the tool, then answer."""
    first = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=True)
    second = tokenizer.apply_chat_template(
        [USER, {"role": "assistant", "content": ""}, {"role": "tool", "content": "5"}], add_generation_prompt=True,
        tokenize=True)
    ids = [list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x) for x in (first, second)]
    eos = [tokenizer.eos_token_id]
    return [(ids[0], tokenizer(CALL, add_special_tokens=False)["input_ids"] + eos),
            (ids[1], tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + eos)]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny chat model trained until greedy decoding calls `add` and then answers (a scripted model)."""
    tokenizer = make_chat_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    torch.random.set_rng_state(state)  # NOTE: leave the suite's global RNG as it was
    rows = [(torch.tensor([p + t]), torch.tensor([[-100] * len(p) + t])) for p, t in _conversations(tokenizer)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):  # NOTE: ~100 steps reach it (the loss bound makes greedy decoding exact)
        worst = 0.0
        for ids, labels in rows:
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            worst = max(worst, loss.item())
        if worst < 0.01:
            break
    model.eval()
    path = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_openai_client_drives_a_tool_using_conversation(tool_model):
    openai = pytest.importorskip("openai")
    from support.serving import serving

    with serving(tool_model, app_kwargs={"tool_call_parser": "hermes"}) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=s.key, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, temperature=0, max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "add"
        args = json.loads(call.function.arguments)
        result = str(args["a"] + args["b"])
        # NOTE: streamed, the same call arrives in the last delta with finish_reason "tool_calls"
        chunks = list(client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, temperature=0,
                                                     max_tokens=80, stream=True))
        streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])] if chunks else []
        assert [tc.function.name for tc in streamed] == ["add"]
        assert json.loads(streamed[0].function.arguments) == args
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        messages = [USER, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": result}]
        final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=40)
        assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"
        assert not final.choices[0].message.tool_calls
        # NOTE: the calling turn may come back without content (OpenAI allows it; agent SDKs send it so)
        bare = [USER, {"role": "assistant", "tool_calls": [call.model_dump()]}, messages[2]]
        again = client.chat.completions.create(model="tiny", messages=bare, tools=TOOLS, temperature=0, max_tokens=40)
        assert again.choices[0].message.content == ANSWER
        # NOTE: tool_choice "none" returns the call as text
        raw = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice="none",
                                             temperature=0, max_tokens=80)
        assert raw.choices[0].message.content == CALL and raw.choices[0].finish_reason == "stop"
        # "required" / a named function force the call's opening into the prompt: the model writes the rest
        tok = make_chat_tokenizer()
        for choice, opening in (("required", "<tool_call>"), ({"type": "function", "function": {"name": "add"}},
                                                               '<tool_call>{"name": "add", "arguments": ')):
            forced = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice=choice,
                                                    temperature=0, max_tokens=80, extra_body={"return_token_ids": True})
            got = forced.choices[0]
            assert got.finish_reason == "tool_calls" and got.message.content is None, got
            assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [
                ("add", args)
            ]
            opening_ids = tok(opening, add_special_tokens=False)["input_ids"]
            prompt_ids = forced.model_extra["prompt_token_ids"]
            assert prompt_ids[-len(opening_ids):] == opening_ids  # the forced text is the prompt's, not sampled
            assert tok.decode(opening_ids + got.model_extra["token_ids"][:-1]) == CALL  # minus the EOS
        # on the answering turn (where "auto" answers in text) "required" still makes the turn a call attempt
        pushed = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                                temperature=0, max_tokens=40).choices[0]
        assert pushed.message.tool_calls or pushed.message.content.startswith("<tool_call>"), pushed
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, max_tokens=8,
                                           tool_choice={"type": "function", "function": {"name": "mul"}})


def test_openai_agents_sdk_runs_a_tool_using_agent(tool_model):
    """The OpenAI Agents SDK (`openai-agents`) against `rollout serve` as an OpenAI-compatible base URL,
    offline: the agent's model calls the Python tool, the SDK sends the result back, the answer ends the run."""
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (pip install openai-agents) is not installed")
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from support.serving import serving

    set_tracing_disabled(True)  # NOTE: the SDK's tracing would upload to OpenAI's servers
    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """a + b"""
        calls.append((a, b))
        return a + b

    with serving(tool_model, app_kwargs={"tool_call_parser": "hermes"}) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=s.key, timeout=60, max_retries=0)
        agent = Agent(name="adder", tools=[add], model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=80))
        result = Runner.run_sync(agent, USER["content"], max_turns=3)
    assert calls == [(2, 3)]
    assert result.final_output == ANSWER
