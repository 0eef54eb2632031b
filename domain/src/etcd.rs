//! A thin client over etcd for the domain: connecting (with timeouts and TLS), the
//! domain-wide settings (written once, then compared), and member join and listing.
//!
//! Every request is bounded by the configuration's request timeout (a third of the lease
//! TTL) with `tokio::time::timeout` rather than the client's own timeout, which would also
//! cut the lease's keepalive stream. Slot claims are in `slots.rs`, the lease in `lease.rs`.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, KeyValue, PutOptions, TlsOptions,
    WatchOptions, WatchStream,
};
use etcd_client::{Txn, TxnOp};
use tracing::warn;

use crate::config::{CONNECT_TIMEOUT, ConfigError, DomainConfig};
use crate::lease::Lease;
use crate::records::{self, DomainSettings, Keys, MemberRecord, Record, RecordError, RecordLimits, SlotClaim};

/// Keys per page of [`DomainClient::read_domain`].
pub const READ_PAGE: i64 = 256;
/// Keys per page of [`DomainClient::list_keys`] (keys without values: names, slot numbers).
pub const KEYS_PAGE: i64 = 4096;

/// Errors from the domain's etcd operations. Each names etcd when etcd is the cause, so a
/// refused domain change says why.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The `[domain]` section is invalid.
    #[error("domain configuration")]
    Config(#[from] ConfigError),
    /// A TLS file could not be read.
    #[error("etcd tls file {path}")]
    TlsFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// etcd could not be reached at connect.
    #[error("etcd at {endpoints}: cannot connect")]
    Connect {
        /// The endpoints tried.
        endpoints: String,
        /// Why.
        #[source]
        source: etcd_client::Error,
    },
    /// An etcd request failed.
    #[error("etcd {op}")]
    Request {
        /// The operation.
        op: &'static str,
        /// Why.
        #[source]
        source: etcd_client::Error,
    },
    /// An etcd request got no answer in time.
    #[error("etcd {op}: no answer within {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// A value in etcd was refused.
    #[error("etcd record at {key}")]
    Record {
        /// The key it was read from.
        key: String,
        /// Why it was refused.
        #[source]
        source: RecordError,
    },
    /// Another live daemon holds this node name.
    #[error("node name {node} is held by a live daemon (incarnation {incarnation}) until its lease ends")]
    NameTaken {
        /// The node name.
        node: String,
        /// The holder's incarnation, `unknown` when its record was unreadable.
        incarnation: String,
    },
    /// The domain's settings contradict this node's.
    #[error("domain setting {field}: the domain has {domain}, this node has {local}")]
    SettingsMismatch {
        /// The setting.
        field: &'static str,
        /// The domain's value.
        domain: String,
        /// This node's value.
        local: String,
    },
    /// The domain's settings key is gone while slots are claimed: settings are not
    /// written again by a joining node, whose own may contradict the GFAs already placed.
    #[error("the domain's settings ({key}) are gone while slots are claimed; an admin must restore them")]
    SettingsGone {
        /// The settings key.
        key: String,
    },
    /// The lease this operation needs has been lost.
    #[error("lease {id:#x} is lost: {reason}")]
    LeaseLost {
        /// The lease.
        id: i64,
        /// Why it was lost.
        reason: String,
    },
    /// A fenced write was refused: this node's membership (incarnation) no longer holds.
    #[error("node {node} incarnation {incarnation} is fenced: {reason}")]
    Fenced {
        /// The node.
        node: String,
        /// The membership's incarnation.
        incarnation: u64,
        /// Why.
        reason: String,
    },
    /// Every slot of the domain is claimed.
    #[error("all {count} slots of the domain are claimed")]
    DomainFull {
        /// How many slots there are.
        count: u32,
    },
    /// A slot claim (or a join, or a gc) kept losing races with other writers of the same
    /// keys.
    #[error("slot claim, join or gc for {node} lost {attempts} races in a row")]
    Contention {
        /// The node.
        node: String,
        /// How many attempts.
        attempts: u32,
    },
    /// The node's slot was freed by an admin's gc while the node was away (or joining): its
    /// memory lies in that slot, so it does not serve another.
    #[error(
        "node {node}'s slot {slot} was collected by an admin's gc ({now}): its memory map lies in that slot; to serve in another, stop the node and remove domain-slot.json and map.record from its state directory (the map is laid out again in the new slot; partition bindings with it)"
    )]
    SlotCollected {
        /// The node.
        node: String,
        /// The slot it served.
        slot: u32,
        /// What became of the slot.
        now: String,
    },
    /// The two keys of a slot claim disagree.
    #[error("slot-of/{node} names slot {slot}, but slots/{slot} is held by {holder}")]
    Inconsistent {
        /// The node.
        node: String,
        /// The slot.
        slot: u32,
        /// Who `slots/<slot>` names (`nobody` when absent).
        holder: String,
    },
    /// A leader's write was refused: its leader key no longer has its term's revision
    /// (another node leads now, or its lease ended).
    #[error("node {node} no longer leads the domain (term {term}): the leader's write is refused")]
    NotLeader {
        /// This node.
        node: String,
        /// The term it led in.
        term: i64,
    },
    /// A shared resource's table in etcd was made for another capacity (or names another
    /// resource) than this node sees.
    #[error("shared memory {resource}: the domain has {domain}, this node has {local}")]
    ShareMismatch {
        /// The resource.
        resource: String,
        /// What the table says.
        domain: String,
        /// What this node sees.
        local: String,
    },
    /// No free range of a shared resource is large enough for this node's share.
    #[error("shared memory {resource}: no free range of {len} bytes for this node's share ({free} bytes unclaimed)")]
    ShareFull {
        /// The resource.
        resource: String,
        /// Bytes asked for.
        len: u64,
        /// Bytes no node holds (perhaps in pieces).
        free: u64,
    },
    /// This node's share of a shared resource was collected while it was away and the
    /// range is not free now (or it holds the share elsewhere): its regions lie there, so
    /// it may not take another.
    #[error(
        "shared memory {resource}: this node's share [{offset:#x}, +{len:#x}) was collected and is held by {holder} now"
    )]
    ShareLost {
        /// The resource.
        resource: String,
        /// Where the node's share was.
        offset: u64,
        /// Its bytes.
        len: u64,
        /// Who holds (part of) the range now.
        holder: String,
    },
    /// An admin tried to free the slot of a node that is a live member.
    #[error("node {node} is a live member: its slot cannot be freed")]
    GcLive {
        /// The node.
        node: String,
    },
}

/// What the domain's member keys hold: the records that decoded, and the values refused.
#[derive(Debug, Default)]
pub struct MemberList {
    /// Valid members, by key order.
    pub members: Vec<MemberRecord>,
    /// Keys whose values were refused, with why. They never enter the list above.
    pub refused: Vec<(String, RecordError)>,
}

/// Tries of a join whose refusal finds no member record.
const JOIN_ATTEMPTS: u32 = 8;

/// How one try of a join ended.
enum Joined {
    Yes,
    /// A live member holds the name: its incarnation (or why it is not known).
    Taken(String),
    /// Refused, and no member holds the name: tried again.
    Again,
}

/// A connection to the domain's etcd, for one node.
#[derive(Clone)]
pub struct DomainClient {
    client: Client,
    keys: Keys,
    node: String,
    limits: RecordLimits,
    lease_ttl: Duration,
    request_timeout: Duration,
}

impl std::fmt::Debug for DomainClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainClient")
            .field("keys", &self.keys)
            .field("node", &self.node)
            .field("lease_ttl", &self.lease_ttl)
            .finish_non_exhaustive()
    }
}

impl DomainClient {
    /// Validates `config`, connects to its endpoints and checks that etcd answers.
    pub async fn connect(config: &DomainConfig, limits: RecordLimits) -> Result<Self, EtcdError> {
        config.validate()?;
        // Requires a leader: a watch served by an etcd member cut off from the cluster is
        // cancelled (and read again elsewhere) instead of going silent while renewals reach
        // a healthy member.
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_keep_alive(config.keepalive_interval(), config.request_timeout())
            .with_require_leader(true);
        if let Some(tls) = &config.tls {
            let mut tls_options = TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca)?));
            if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
                tls_options = tls_options.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            if let Some(name) = &tls.server_name {
                tls_options = tls_options.domain_name(name.clone());
            }
            options = options.with_tls(tls_options);
        }
        let endpoints = config.endpoints.join(",");
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, Client::connect(&config.endpoints, Some(options))).await;
        let client = match connected {
            Ok(Ok(client)) => client,
            Ok(Err(source)) => return Err(EtcdError::Connect { endpoints, source }),
            Err(_) => return Err(EtcdError::Timeout { op: "connect", after: CONNECT_TIMEOUT }),
        };
        let this = Self {
            client,
            keys: Keys::new(&config.name),
            node: config.node.clone(),
            limits,
            lease_ttl: config.lease_ttl(),
            request_timeout: config.request_timeout(),
        };
        // The client connects lazily: one cheap read proves etcd answers.
        let mut kv = this.client.clone();
        let probe = GetOptions::new().with_count_only();
        this.call("connect", kv.get(this.keys.settings(), Some(probe))).await?;
        Ok(this)
    }

    /// The domain's keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The record decoder's bounds.
    pub fn limits(&self) -> RecordLimits {
        self.limits
    }

    /// The underlying etcd client (for admin tools and tests).
    pub fn raw(&self) -> Client {
        self.client.clone()
    }

    /// Every record under the domain's prefix at one revision, and that revision: the
    /// domain read in pages ([`Self::read_prefix`]).
    pub async fn read_domain(&self) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        self.read_prefix("domain read", self.keys.prefix()).await
    }

    /// Every record under `prefix` at one revision, and that revision. Read in pages of
    /// [`READ_PAGE`] keys, each at the first page's revision: the whole domain in one
    /// response would pass gRPC's 4 MiB message limit at about 2,600 nodes (a node is about
    /// 1.5 KiB of records), while a page stays under [`Self::message_limit`].
    ///
    /// Records are untrusted: values past the record bound (up to etcd's own request
    /// limit, 1.5 MiB by default) can make a page larger than the limit. Such a page is
    /// asked again with half as many keys, down to one; a single key whose value alone is
    /// past the limit is left out, with a warning that names it. So junk under a prefix
    /// costs more pages, never the whole read.
    pub async fn read_prefix(&self, op: &'static str, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        self.read_pages(op, prefix, false).await
    }

    /// The keys under `prefix` at one revision, without their values, in pages as
    /// [`Self::read_prefix`] reads them: however many there are. A key that is not UTF-8
    /// (no name of this domain is) is left out.
    pub async fn list_keys(&self, op: &'static str, prefix: &str) -> Result<Vec<String>, EtcdError> {
        let (kvs, _) = self.read_pages(op, prefix, true).await?;
        Ok(kvs.into_iter().filter_map(|kv| String::from_utf8(kv.key().to_vec()).ok()).collect())
    }

    async fn read_pages(
        &self,
        op: &'static str,
        prefix: &str,
        keys_only: bool,
    ) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        let prefix = prefix.as_bytes().to_vec();
        let end = prefix_end(&prefix);
        let mut kv = self.client.kv_client().max_decoding_message_size(self.message_limit());
        let (mut from, mut revision, mut all) = (prefix, 0, Vec::new());
        let page_keys = if keys_only { KEYS_PAGE } else { READ_PAGE };
        let mut limit = page_keys;
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(limit).with_revision(revision);
            if keys_only {
                options = options.with_keys_only();
            }
            let mut page = match self.call(op, kv.get(from.clone(), Some(options))).await {
                Err(e) if past_message_limit(&e) && limit > 1 => {
                    limit /= 2;
                    continue;
                }
                Err(e) if past_message_limit(&e) => {
                    // One key whose value alone is past the limit: its name, to skip it.
                    let options = GetOptions::new()
                        .with_range(end.clone())
                        .with_keys_only()
                        .with_limit(1)
                        .with_revision(revision);
                    let named = self.call(op, kv.get(from.clone(), Some(options))).await?;
                    if revision == 0 {
                        revision = named.header().map_or(0, |h| h.revision());
                    }
                    let Some(key) = named.kvs().first().map(|k| k.key().to_vec()) else { return Err(e) };
                    warn!(key = %String::from_utf8_lossy(&key), limit = self.message_limit(),
                        "a record is past the message limit; left out");
                    from = key;
                    from.push(0);
                    limit = page_keys;
                    continue;
                }
                other => other?,
            };
            if revision == 0 {
                revision = page.header().map_or(0, |h| h.revision());
            }
            let more = page.more();
            let kvs = page.take_kvs();
            let Some(last) = kvs.last() else { break };
            // The next page starts just after the last key read.
            from = last.key().to_vec();
            from.push(0);
            all.extend(kvs);
            if !more {
                break;
            }
            limit = page_keys;
        }
        Ok((all, revision))
    }

    /// A watch of every record under the domain's prefix from `revision` on, allowed
    /// responses as large as [`Self::message_limit`]: etcd may send many revisions'
    /// events in one response to a watcher catching up.
    pub async fn watch_domain(&self, revision: i64) -> Result<WatchStream, EtcdError> {
        let mut watch = self.client.watch_client().max_decoding_message_size(self.message_limit());
        let options = WatchOptions::new().with_prefix().with_start_revision(revision);
        self.call("domain watch", watch.watch(self.keys.prefix(), Some(options))).await
    }

    /// The largest gRPC message [`Self::read_domain`] and [`Self::watch_domain`] accept:
    /// a page of records at the decoder's bound, with room for keys and headers.
    pub fn message_limit(&self) -> usize {
        usize::try_from(READ_PAGE).unwrap_or(256) * (self.limits.max_bytes() + 1024) + (1 << 20)
    }

    /// Grants this node a lease of the configured TTL and starts renewing it.
    pub async fn grant_lease(&self) -> Result<Lease, EtcdError> {
        self.grant_lease_asked(crate::lease::Asked::now()).await
    }

    /// [`Self::grant_lease`], the grant sent at `asked` (tests give it a boot clock that
    /// jumps).
    pub(crate) async fn grant_lease_asked(&self, asked: crate::lease::Asked) -> Result<Lease, EtcdError> {
        let mut lease = self.client.clone();
        let ttl = i64::try_from(self.lease_ttl.as_secs()).unwrap_or(i64::MAX);
        let granted = self.call("lease grant", lease.lease_grant(ttl, None)).await?;
        Ok(Lease::start(self.client.clone(), granted.id(), self.lease_ttl, self.request_timeout, asked))
    }

    /// Makes the domain's settings `local` if none are written yet; otherwise reads them and
    /// refuses, naming both values, when they differ from `local`.
    ///
    /// Settings are written only into a domain where no slot is claimed (one transaction):
    /// once a slot holds GFAs placed under them, a deleted settings key is not written again
    /// by whoever joins next, whose settings may contradict those GFAs (`SettingsGone`; an
    /// admin restores the key, from any node's `fabricctl domain status -o json`).
    pub async fn ensure_settings(&self, local: &DomainSettings) -> Result<DomainSettings, EtcdError> {
        self.ensure_settings_with(local, true).await
    }

    /// [`DomainClient::ensure_settings`]; where `own_data_paths` is false (the node's
    /// configuration names none, and `local` carries the defaults), the domain's data paths
    /// are taken as they are written: only the other settings must agree.
    pub async fn ensure_settings_with(
        &self,
        local: &DomainSettings,
        own_data_paths: bool,
    ) -> Result<DomainSettings, EtcdError> {
        let key = self.keys.settings();
        let unclaimed = Compare::create_revision(self.keys.slots(), CompareOp::Equal, 0).with_prefix();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0), unclaimed])
            .and_then([TxnOp::put(key.clone(), records::encode(local), None)]);
        let mut kv = self.client.clone();
        if self.call("settings write", kv.txn(txn)).await?.succeeded() {
            return Ok(local.clone());
        }
        let domain: DomainSettings =
            self.get_record(&key).await?.ok_or_else(|| EtcdError::SettingsGone { key: key.clone() })?;
        let adopted;
        let local = if own_data_paths {
            local
        } else {
            adopted = DomainSettings { data_paths: domain.data_paths.clone(), ..local.clone() };
            &adopted
        };
        match domain.difference(local) {
            Some((field, domain, local)) => Err(EtcdError::SettingsMismatch { field, domain, local }),
            None => Ok(domain),
        }
    }

    /// Joins the domain: writes `record` (this node's) on `lease`, unless another live daemon
    /// holds the name.
    pub async fn join(&self, lease: &Lease, record: &MemberRecord) -> Result<(), EtcdError> {
        self.join_checked(lease, record, None).await
    }

    /// [`DomainClient::join`], in the same transaction as a check that this node still holds
    /// `slot` (its `slot-of` key, which only an admin's gc deletes, with the slot): a gc
    /// that commits between the node's reading its slot and its join refuses the join
    /// (`SlotCollected`) instead of leaving a member that serves a slot it no longer
    /// holds — as does a claim of another slot under this name meanwhile (a gc, then a
    /// second daemon of the same name); one that comes after finds the member key and is
    /// refused.
    pub async fn join_in_slot(&self, lease: &Lease, record: &MemberRecord, slot: u32) -> Result<(), EtcdError> {
        self.join_checked(lease, record, Some(slot)).await
    }

    async fn join_checked(&self, lease: &Lease, record: &MemberRecord, slot: Option<u32>) -> Result<(), EtcdError> {
        let key = self.keys.member(&self.node);
        record.validate().map_err(|source| EtcdError::Record { key: key.clone(), source })?;
        if record.name != self.node {
            let reason = format!("names {:?}, this node is {:?}", record.name, self.node);
            return Err(EtcdError::Record { key, source: RecordError::Invalid { field: "name", reason } });
        }
        // A refusal that finds no member record (the slot claim rewritten unchanged
        // between its read and the transaction, or the holder's lease ending just then)
        // is tried again, a few times; before, it read as a live holder of "unknown"
        // incarnation.
        for _ in 0..JOIN_ATTEMPTS {
            lease.check()?;
            match self.join_once(lease, record, &key, slot).await? {
                Joined::Yes => return Ok(()),
                Joined::Taken(incarnation) => {
                    return Err(EtcdError::NameTaken { node: self.node.clone(), incarnation });
                }
                Joined::Again => {}
            }
        }
        Err(EtcdError::Contention { node: self.node.clone(), attempts: JOIN_ATTEMPTS })
    }

    /// One try of [`DomainClient::join_checked`].
    async fn join_once(
        &self,
        lease: &Lease,
        record: &MemberRecord,
        key: &str,
        slot: Option<u32>,
    ) -> Result<Joined, EtcdError> {
        let reverse = self.keys.slot_of(&self.node);
        let mut compares = vec![Compare::create_revision(key.to_owned(), CompareOp::Equal, 0)];
        if let Some(slot) = slot {
            // That very claim, not any: a gc and another daemon of this name claiming a
            // new slot meanwhile would otherwise let this one serve a slot someone else
            // holds now.
            let collected = |now: String| EtcdError::SlotCollected { node: self.node.clone(), slot, now };
            let Some((value, revision)) = self.get_raw(&reverse).await? else {
                return Err(collected("before the node joined".to_owned()));
            };
            let held: SlotClaim = self.decode(&reverse, &value)?;
            if held.slot != slot || held.node != self.node {
                return Err(collected(format!("this node holds slot {} now", held.slot)));
            }
            compares.push(Compare::mod_revision(reverse.clone(), CompareOp::Equal, revision));
        }
        let txn = Txn::new().when(compares).and_then([TxnOp::put(
            key.to_owned(),
            records::encode(record),
            Some(PutOptions::new().with_lease(lease.id())),
        )]);
        let mut kv = self.client.clone();
        if self.call("member join", kv.txn(txn)).await?.succeeded() {
            return Ok(Joined::Yes);
        }
        if let Some(slot) = slot {
            let now = match self.get_raw(&reverse).await? {
                None => Some("while the node joined".to_owned()),
                Some((value, _)) => match self.decode::<SlotClaim>(&reverse, &value) {
                    Ok(held) if held.slot == slot && held.node == self.node => None,
                    Ok(held) => Some(format!("this node holds slot {} now", held.slot)),
                    Err(e) => return Err(e),
                },
            };
            if let Some(now) = now {
                return Err(EtcdError::SlotCollected { node: self.node.clone(), slot, now });
            }
        }
        match self.get_record::<MemberRecord>(key).await {
            Ok(Some(holder)) => Ok(Joined::Taken(holder.incarnation.to_string())),
            // No member: the claim was rewritten unchanged since it was read, or the
            // holder's lease ended just now.
            Ok(None) => Ok(Joined::Again),
            Err(e @ EtcdError::Record { .. }) => Ok(Joined::Taken(format!("unknown: {e}"))),
            Err(e) => Err(e),
        }
    }

    /// Leaves the domain: revokes the lease, which deletes the member record with it.
    pub async fn leave(&self, lease: Lease) -> Result<(), EtcdError> {
        let id = lease.id();
        drop(lease);
        let mut client = self.client.clone();
        self.call("lease revoke", client.lease_revoke(id)).await.map(drop)
    }

    /// Every member record of the domain; values that do not decode (or whose name is not
    /// their key's) are refused, logged and listed apart.
    pub async fn members(&self) -> Result<MemberList, EtcdError> {
        let prefix = self.keys.members();
        let (entries, _) = self.read_prefix("members read", &prefix).await?;
        let mut list = MemberList::default();
        for entry in &entries {
            let key = String::from_utf8_lossy(entry.key()).into_owned();
            let name = key.strip_prefix(&prefix).unwrap_or_default();
            let decoded = records::decode::<MemberRecord>(entry.value(), self.limits).and_then(|record| {
                if record.name == name {
                    Ok(record)
                } else {
                    let reason = format!("{:?} under the key of {name:?}", record.name);
                    Err(RecordError::Invalid { field: "name", reason })
                }
            });
            match decoded {
                Ok(record) => list.members.push(record),
                Err(error) => {
                    warn!(%key, %error, "refused a member record");
                    list.refused.push((key, error));
                }
            }
        }
        Ok(list)
    }

    /// Reads and decodes one record; `None` when the key is absent.
    pub(crate) async fn get_record<R: Record>(&self, key: &str) -> Result<Option<R>, EtcdError> {
        match self.get_raw(key).await? {
            Some((value, _)) => self.decode(key, &value).map(Some),
            None => Ok(None),
        }
    }

    /// One key's value and modification revision; `None` when it is absent.
    pub(crate) async fn get_raw(&self, key: &str) -> Result<Option<(Vec<u8>, i64)>, EtcdError> {
        self.get_raw_at(key, None).await.map(|(entry, _)| entry)
    }

    /// [`Self::get_raw`] as of `revision` (`None`: now), with the revision read at: a
    /// second read at that revision sees the store as the first did.
    pub(crate) async fn get_raw_at(
        &self,
        key: &str,
        revision: Option<i64>,
    ) -> Result<(Option<(Vec<u8>, i64)>, i64), EtcdError> {
        let mut kv = self.client.clone();
        let options = revision.map(|r| etcd_client::GetOptions::new().with_revision(r));
        let response = self.call("read", kv.get(key, options)).await?;
        let at = response.header().map_or(0, |h| h.revision());
        Ok((response.kvs().first().map(|entry| (entry.value().to_vec(), entry.mod_revision())), revision.unwrap_or(at)))
    }

    /// Decodes a value read from `key`, naming the key when refused.
    pub(crate) fn decode<R: Record>(&self, key: &str, value: &[u8]) -> Result<R, EtcdError> {
        records::decode(value, self.limits).map_err(|source| {
            warn!(%key, error = %source, "refused an etcd record");
            EtcdError::Record { key: key.to_owned(), source }
        })
    }

    /// Runs one etcd request under the request timeout.
    pub async fn call<T>(
        &self,
        op: &'static str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, EtcdError> {
        match tokio::time::timeout(self.request_timeout, request).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(source)) => Err(EtcdError::Request { op, source }),
            Err(_) => Err(EtcdError::Timeout { op, after: self.request_timeout }),
        }
    }
}

/// Whether `e` is a response refused for being past the client's message limit.
fn past_message_limit(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Request { source: etcd_client::Error::GRpcStatus(s), .. }
        if s.code() == tonic::Code::OutOfRange && s.message().contains("message length too large"))
}

/// A fresh incarnation for this start of the daemon: nanoseconds since the Unix epoch, so
/// it grows across restarts of one node as long as its clock does; never 0.
pub fn fresh_incarnation() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    u64::try_from(nanos).unwrap_or(u64::MAX).max(1)
}

/// The end of the range of keys starting with `prefix` (its last byte that is not 0xff,
/// plus one); `\0` — every key — when there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|source| EtcdError::TlsFile { path: path.to_owned(), source })
}
