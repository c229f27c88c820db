"""Experiments: the papers' tables as studies and the runner that trains their rows.

:mod:`.study` says what a study is (a paper table of rows, with the paper's figures); :mod:`.papers` holds
every paper's tables, one file per paper; :mod:`.runner` trains and evaluates a set of variants (``vitlab
compare`` and each study); :mod:`.reproduce` runs one study beside the paper's numbers; :mod:`.launch` runs a
row under ``torchrun``; :mod:`.resolution` evaluates one checkpoint at larger inputs.
"""
