import subprocess

from kvpool.measure import provenance


def commit_in(repo):
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.txt").write_text("a\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_and_a_dirty_tree_are_read_from_git(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOOL_GIT_COMMIT", raising=False)
    head = commit_in(tmp_path)
    assert provenance.git_commit(tmp_path) == {"commit": head, "dirty": False, "changed_files": []}
    (tmp_path / "f.txt").write_text("b\n")
    assert provenance.git_commit(tmp_path) == {"commit": head, "dirty": True, "changed_files": ["f.txt"]}


def test_a_copied_tree_names_its_commit_instead_of_trusting_a_stale_git(tmp_path, monkeypatch):
    commit_in(tmp_path)
    monkeypatch.setenv("KVPOOL_GIT_COMMIT", "0123abc")
    monkeypatch.delenv("KVPOOL_GIT_DIRTY", raising=False)
    assert provenance.git_commit(tmp_path) == {"commit": "0123abc", "dirty": None, "source": "KVPOOL_GIT_COMMIT"}
    monkeypatch.setenv("KVPOOL_GIT_DIRTY", "1")  # the sender says its tree had uncommitted changes
    assert provenance.git_commit(tmp_path)["dirty"] is True


def test_a_manifest_names_the_commit_of_kvpool_s_own_checkout(monkeypatch):
    monkeypatch.delenv("KVPOOL_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(provenance.REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    found = provenance.manifest({"chunk_sizes": [256]}, cell="x")
    assert found["git"]["commit"] == head and found["config"] == {"chunk_sizes": [256]} and found["cell"] == "x"
    assert (provenance.REPO / "Snakefile").exists()
