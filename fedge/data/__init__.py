"""Corpus, client data sources, partitioners and the tokenized federated corpus."""

from fedge.data.federated import ClientTokens, FederatedCorpus, build_federated_corpus
from fedge.data.partition import SCHEMES, PartitionSpec, partition_documents
from fedge.data.sources import Document, load_documents

__all__ = [
    "SCHEMES",
    "ClientTokens",
    "Document",
    "FederatedCorpus",
    "PartitionSpec",
    "build_federated_corpus",
    "load_documents",
    "partition_documents",
]
