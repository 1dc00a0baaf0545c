"""Vision-encoder CUDA graphs (runner/encoder_graph.py) against the eager encoder on tiny LLaVA
folders: every tile count (padded up, split past the largest capture), and whole generations
through the engine with graphs on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["llava", "llava_next"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmserver.testing.multimodal import make_tiny_llava_folder

    return make_tiny_llava_folder(tmp_path_factory.mktemp(request.param), request.param, seed=4)


def test_graphs_equal_the_eager_encoder(folder: Path) -> None:
    from lmserver.models.loader import load_model, read_model_config
    from lmserver.runner.encoder_graph import EncoderGraphs

    config = read_model_config(folder)
    model = load_model(config, folder, dtype=torch.float32, device="cuda")

    def eager(pixels: torch.Tensor) -> torch.Tensor:
        return model.multi_modal_projector(model.vision_features(pixels))  # type: ignore[no-any-return]

    graphs = EncoderGraphs(eager, model.tile_shape(), torch.float32, torch.device("cuda"), tile_counts=(1, 2, 4))
    graphs.capture()
    for n in (1, 3, 4, 9):  # 3: padded to 4; 9: three pieces of at most 4
        pixels = torch.randn((n, *model.tile_shape()), device="cuda")
        with torch.inference_mode():
            want = eager(pixels)
        got = graphs(pixels)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphs.replays == 1 + 1 + 1 + 3


def test_engine_outputs_equal_with_and_without_graphs(folder: Path, tmp_path: Path) -> None:
    import io

    import numpy as np
    from PIL import Image

    from lmserver import Engine

    paths = []
    for i, size in enumerate([(40, 56), (90, 30)]):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
        path = tmp_path / f"{i}.png"
        path.write_bytes(buf.getvalue())
        paths.append(str(path))
    prompt = "USER: <image>\nA <image>\nB ASSISTANT:"
    outs = []
    for disable in (False, True):
        eng = Engine(str(folder), dtype="float32", device="cuda", max_total_tokens=4096, max_running_requests=4,
                     disable_cuda_graph=disable)
        try:
            assert (eng.core.model.tile_encoder is None) == disable
            out = eng.generate(prompt, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                               image_data=paths, return_logprob=True)
            assert isinstance(out, dict)
            outs.append(out)
        finally:
            eng.shutdown()
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    np.testing.assert_allclose([e[0] for e in outs[0]["meta_info"]["output_token_logprobs"]],
                               [e[0] for e in outs[1]["meta_info"]["output_token_logprobs"]], atol=1e-4)
