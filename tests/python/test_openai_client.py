"""`tm-cli serve` with the official `openai` package: chat completion, streamed chat
completion, completion, models list.

Needs a running server: TM_BASE_URL (default http://127.0.0.1:8000/v1) and TM_MODEL (default:
the first model the server lists). run_openai_test.sh starts one with the default model.
Run: python3 tests/python/test_openai_client.py
"""

import os
import sys
import unittest

import openai

BASE_URL = os.environ.get("TM_BASE_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("TM_API_KEY", "unused")


class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0, timeout=120)
        models = cls.client.models.list()
        cls.model = os.environ.get("TM_MODEL") or models.data[0].id

    def test_models_list(self):
        models = self.client.models.list()
        ids = [m.id for m in models.data]
        self.assertIn(self.model, ids)
        self.assertEqual(models.data[0].object, "model")

    def test_chat_completion(self):
        r = self.client.chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            max_tokens=16,
            temperature=0,
            seed=1,
        )
        self.assertEqual(len(r.choices), 1)
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertTrue(r.choices[0].message.content.strip())
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertGreater(r.usage.completion_tokens, 0)
        self.assertLessEqual(r.usage.completion_tokens, 16)
        self.assertIn("Paris", r.choices[0].message.content)

    def test_streamed_chat_completion(self):
        messages = [{"role": "user", "content": "Count from one to five."}]
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage, chunks = "", None, None, 0
        for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        self.assertGreater(chunks, 2)
        self.assertTrue(text.strip())
        self.assertIn(finish, ("stop", "length"))
        self.assertIsNotNone(usage)
        self.assertLessEqual(usage.completion_tokens, 20)
        plain = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=20, temperature=0)
        self.assertEqual(plain.choices[0].message.content, text)

    def test_completion(self):
        r = self.client.completions.create(model=self.model, prompt="The capital of France is", max_tokens=8, temperature=0)
        self.assertEqual(len(r.choices), 1)
        self.assertTrue(r.choices[0].text)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 0)

    def test_errors(self):
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        self.assertEqual(e.exception.status_code, 400)
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "hi"}], temperature=7
            )


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() else 1)
