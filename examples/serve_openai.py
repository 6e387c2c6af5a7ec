"""`pagedllm serve` and the official openai client: chat (whole and streamed), a tool call, and the Responses API
continuing a stored conversation. The server runs in a subprocess on a free port, its log in a file."""

import openai
from local_server import local_server

with local_server() as url:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="smol", messages=question, max_tokens=24, temperature=0)
    print("chat:", reply.choices[0].message.content)
    stream = client.chat.completions.create(model="smol", messages=question, max_tokens=24, temperature=0, stream=True)
    print("streamed:", "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(
        model="smol", messages=asked, tools=[weather], tool_choice="required", max_tokens=48, temperature=0
    )
    print("tool call:", called.choices[0].message.tool_calls[0].function)

    first = client.responses.create(model="smol", input="Name a colour.", max_output_tokens=16, temperature=0)
    second = client.responses.create(
        model="smol", input="And another one?", previous_response_id=first.id, max_output_tokens=16, temperature=0
    )
    print("responses:", first.output_text, "|", second.output_text)
