"""The OpenAI Agents SDK on `pagedllm serve`: an agent on the Responses API calls a function tool and answers."""

import asyncio

import openai
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from local_server import local_server


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


with local_server() as url:
    set_tracing_disabled(True)  # nothing leaves this machine
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    agent = Agent(
        name="weather",
        instructions="Use the tool, then answer in one sentence.",
        model=OpenAIResponsesModel(model="smol", openai_client=client),
        tools=[get_weather],
        # The small model rarely calls a tool on its own; the SDK lets it answer freely after the call.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    print(result.final_output)
