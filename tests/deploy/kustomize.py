"""A small kustomize renderer for the manifest tests, used where `kubectl` is not installed (and checked
against `kubectl kustomize` where it is). It covers what deploy/k8s uses and nothing more: `resources`
(files and directories), `components`, `namespace`, `configMapGenerator` literals (with
`behavior: merge`), strategic-merge patch files for Deployments (maps merged, lists of named items
merged by name), inline JSON 6902 `add` patches with a label-selector target, and `images`. Generated
ConfigMaps keep their plain names (kubectl adds a content hash and rewrites the references)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]


def kubectl() -> str | None:
    """The kubectl binary, if installed."""
    return shutil.which("kubectl")


def render_with_kubectl(directory: Path) -> list[Doc]:
    """`kubectl kustomize DIRECTORY`, parsed."""
    binary = kubectl()
    assert binary is not None
    out = subprocess.run(
        [binary, "kustomize", str(directory)], check=True, capture_output=True, text=True, timeout=60
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def read_kustomization(directory: Path) -> Doc:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def render(directory: Path) -> list[Doc]:
    """The documents `kubectl kustomize DIRECTORY` would print (up to generated names' hashes)."""
    kustomization = read_kustomization(directory)
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for generator in kustomization.get("configMapGenerator", []):
        _generate_config_map(docs, generator)
    for entry in kustomization.get("components", []):
        docs = _apply_component(docs, directory / entry)
    for patch in kustomization.get("patches", []):
        docs = _apply_patch(docs, directory, patch)
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                if container.get("image") == image["name"]:
                    container["image"] = (
                        f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
                    )
    return docs


def _containers(doc: Doc) -> list[Doc]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _generate_config_map(docs: list[Doc], generator: Doc) -> None:
    data = dict(line.split("=", 1) for line in generator.get("literals", []))
    existing = next(
        (d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == generator["name"]), None
    )
    if generator.get("behavior") == "merge":
        assert existing is not None, f"merge into a missing ConfigMap {generator['name']}"
        existing["data"].update(data)
        return
    assert existing is None, f"ConfigMap {generator['name']} generated twice"
    docs.append(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}
    )


def _apply_component(docs: list[Doc], directory: Path) -> list[Doc]:
    component = read_kustomization(directory)
    assert component["kind"] == "Component", directory
    for entry in component.get("resources", []):
        docs.extend(d for d in yaml.safe_load_all((directory / entry).read_text()) if d)
    for patch in component.get("patches", []):
        docs = _apply_patch(docs, directory, patch)
    return docs


def _apply_patch(docs: list[Doc], directory: Path, patch: Doc) -> list[Doc]:
    if "path" in patch:
        overlay = yaml.safe_load((directory / patch["path"]).read_text())
        target = next(
            (
                d
                for d in docs
                if d["kind"] == overlay["kind"] and d["metadata"]["name"] == overlay["metadata"]["name"]
            ),
            None,
        )
        assert target is not None, f"patch {patch['path']} matches no resource"
        merged = _merge(target, overlay)
        return [merged if d is target else d for d in docs]
    selector = dict(item.split("=", 1) for item in patch["target"]["labelSelector"].split(","))
    operations = yaml.safe_load(patch["patch"])
    for doc in docs:
        labels = doc.get("metadata", {}).get("labels", {})
        if doc["kind"] == patch["target"]["kind"] and all(labels.get(k) == v for k, v in selector.items()):
            for op in operations:
                _json_patch_add(doc, op)
    return docs


def _merge(base: Any, overlay: Any) -> Any:
    """Strategic merge as kustomize does it for the fields deploy/k8s patches."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        merged = copy.deepcopy(base)
        for key, value in overlay.items():
            merged[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if (
        isinstance(base, list)
        and isinstance(overlay, list)
        and all(isinstance(item, dict) and "name" in item for item in base + overlay)
    ):
        merged_list = [copy.deepcopy(item) for item in base]
        for item in overlay:
            index = next((i for i, old in enumerate(merged_list) if old["name"] == item["name"]), None)
            if index is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[index] = _merge(merged_list[index], item)
        return merged_list
    return copy.deepcopy(overlay)


def _json_patch_add(doc: Doc, op: Doc) -> None:
    assert op["op"] == "add", op
    *parents, last = op["path"].strip("/").split("/")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if last == "-":
        node.append(copy.deepcopy(op["value"]))
    else:
        node[last] = copy.deepcopy(op["value"])
