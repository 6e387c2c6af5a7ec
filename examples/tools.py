"""Tool calling over `pagedllm serve` with the openai client: the model calls a function, the script runs it and
sends its result back as a `role: "tool"` message, and the model answers with it.

SmolLM2's chat template knows no tools, so pagedllm renders them in the Hermes `<tool_call>` form and reads the call
back out of the reply; `tool_choice="required"` holds the first reply to a call with a JSON schema built from the
tool's parameters, so even a 135M model calls it well-formed."""

import json

import openai
from local_server import local_server


def get_weather(city: str) -> dict:
    """The tool itself: here a fixed answer, in practice an API call."""
    return {"city": city, "forecast": "sunny", "temperature_c": 24}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


with local_server() as url:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    reason = first.choices[0].finish_reason
    print("tool call:", call.function.name, call.function.arguments, f"(finish_reason {reason})")

    result = get_weather(**json.loads(call.function.arguments))
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    # A small model needs telling what to do with the result; a larger one answers from it unasked.
    messages.append({"role": "user", "content": "Now tell me the weather in one sentence."})
    final = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=48, temperature=0
    )
    print("tool result:", result)
    print("answer:", final.choices[0].message.content)
