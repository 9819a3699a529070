{{/*
One PD tier (Deployment + headless Service); call with (dict "ctx" $ "role" "prefill").
The node binds and advertises the pod IP: the registry record's http_url is built from
--host:--port, so binding 0.0.0.0 would publish an unreachable address.
*/}}
{{- define "pdserve.pdTier" -}}
{{- $ := .ctx -}}
{{- $role := .role -}}
{{- $tier := index $.Values $role -}}
{{- $fullname := include "pdserve.fullname" $ -}}
{{- $rdma := $.Values.rdma.enabled -}}
{{- $hostNet := and $rdma $.Values.rdma.hostNetwork -}}
{{- $sc := deepCopy ($.Values.securityContext | default dict) -}}
{{- if $rdma -}}
{{- $caps := deepCopy (get $sc "capabilities" | default dict) -}}
{{- $add := get $caps "add" | default list -}}
{{- $_ := set $caps "add" (append $add "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- if $.Values.rdma.runAsRoot -}}
{{/* IPC_LOCK lifts the memlock limit only for root: a non-root user gets no ambient
capabilities. Else the runtime's memlock limit must be raised (docs/deploy.md: RDMA). */}}
{{- $_ := set $sc "runAsUser" 0 -}}
{{- $_ := set $sc "runAsGroup" 0 -}}
{{- $_ := set $sc "runAsNonRoot" false -}}
{{- end -}}
{{- end -}}
{{- $pd := $.Values.pd -}}
{{- $res := deepCopy ($tier.resources | default dict) -}}
{{- if $rdma -}}
{{- $req := deepCopy (get $res "requests" | default dict) -}}
{{- $lim := deepCopy (get $res "limits" | default dict) -}}
{{- $_ := set $req $.Values.rdma.resourceName ($.Values.rdma.resourceCount | toString) -}}
{{- $_ := set $lim $.Values.rdma.resourceName ($.Values.rdma.resourceCount | toString) -}}
{{- $_ := set $res "requests" $req -}}
{{- $_ := set $res "limits" $lim -}}
{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" (dict "ctx" $ "component" $role) | nindent 4 }}
spec:
  {{- if not (index $.Values.autoscaling $role).enabled }}{{/* else the autoscaler owns it */}}
  replicas: {{ $tier.replicas }}
  {{- end }}
  {{- if $hostNet }}
  # Host ports: a surge pod cannot start where the old one still holds them.
  strategy:
    {{- toYaml $.Values.rdma.strategy | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" (dict "ctx" $ "component" $role) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" (dict "ctx" $ "component" $role) | nindent 8 }}
      {{- $ann := include "pdserve.podAnnotations" (dict "ctx" $ "port" $tier.port "extra" $tier.podAnnotations) | trim }}
      {{- $sums := include "pdserve.secretChecksums" (dict "ctx" $ "store" false) | trim }}
      {{- if or $ann $sums }}
      annotations:
        {{- with $ann }}{{ . | nindent 8 }}{{ end }}
        {{- with $sums }}{{ . | nindent 8 }}{{ end }}
      {{- end }}
    spec:
      # preStop, then the drain (deregister, open requests finish), then a margin.
      terminationGracePeriodSeconds: {{ add $pd.preStopSleepS $pd.drainTimeoutS $pd.drainGraceS 15 }}
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $hostNet }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- with $.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "pdserve.modelInit" $ | trim) }}{{ . | nindent 6 }}{{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $ }}
          imagePullPolicy: {{ $.Values.image.pullPolicy }}
          command: ["pdserve"]
          args:
            - {{ $role }}
            - --model
            - {{ $.Values.model.name | quote }}
            {{- with $.Values.model.servedModelName }}
            - --served-model-name
            - {{ . | quote }}
            {{- end }}
            - --model-cache-dir
            - {{ include "pdserve.cacheDir" $ | quote }}
            {{- with $.Values.model.revision }}
            - --revision
            - {{ . | quote }}
            {{- end }}
            - --load-format
            - {{ $.Values.model.loadFormat | quote }}
            - --registry
            - {{ include "pdserve.registryUrl" $ | quote }}
            {{- if $.Values.registry.auth.enabled }}
            - --registry-token-file
            - {{ include "pdserve.tokenPath" $ }}
            {{- end }}
            - --registry-ttl-s
            - {{ $pd.registryTtlS | quote }}
            - --drain-timeout-s
            - {{ $pd.drainTimeoutS | quote }}
            - --drain-grace-s
            - {{ $pd.drainGraceS | quote }}
            - --node-id
            - $(POD_NAME)
            - --host
            - $(POD_IP)
            - --port
            - {{ $tier.port | quote }}
            - --kv-host
            - $(POD_IP)
            - --transfer-backend
            - {{ $.Values.transfer.backend }}
            {{- if eq $.Values.transfer.backend "mooncake" }}
            - --mooncake-protocol
            - {{ ternary "rdma" $.Values.transfer.mooncakeProtocol $rdma }}
            {{- if $rdma }}
            - --mooncake-device
            - {{ $.Values.rdma.device | quote }}
            {{- end }}
            {{- end }}
            - --dtype
            - {{ $.Values.engine.dtype }}
            - --device
            - {{ $.Values.engine.device | quote }}
            - --page-size
            - {{ $.Values.engine.pageSize | quote }}
            - --tp-size
            - {{ $.Values.engine.tpSize | default 1 | quote }}
            - --max-running-requests
            - {{ $tier.maxRunningRequests | quote }}
            - --kv-cache-mb
            - {{ $tier.kvCacheMb | quote }}
            - --threads
            - {{ $tier.threads | default 0 | quote }}
            {{- if eq $role "prefill" }}
            - --chunked-prefill-size
            - {{ $tier.chunkedPrefillSize | quote }}
            {{- end }}
            - --log-level
            - {{ $.Values.engine.logLevel }}
            {{- with $tier.hicache }}{{ if .enabled }}
            - --enable-hierarchical-cache
            - --hicache-ratio
            - {{ .ratio | quote }}
            - --hicache-size
            - {{ .sizeGb | quote }}
            - --hicache-write-policy
            - {{ .writePolicy | quote }}
            {{- end }}{{ end }}
            {{- if and (eq $role "prefill") $.Values.kvStore.enabled }}
            - --enable-hierarchical-cache
            - --hicache-storage-backend
            - mooncake
            - --hicache-mooncake-master
            - {{ printf "%s-kv-store:%v" (include "pdserve.fullname" $) $.Values.kvStore.rpcPort | quote }}
            - --hicache-mooncake-metadata-url
            - {{ printf "http://%s-kv-store:%v/metadata" (include "pdserve.fullname" $) $.Values.kvStore.metadataPort | quote }}
            - --hicache-mooncake-host
            - $(POD_IP)
            - --hicache-mooncake-segment-mb
            - {{ $.Values.kvStore.segmentMb | quote }}
            - --hicache-mooncake-protocol
            - {{ $.Values.kvStore.protocol | quote }}
            {{- end }}
            {{- range $tier.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "pdserve.commonEnv" $ | nindent 12 }}
            {{- if and $rdma (ne (toString $.Values.rdma.gidIndex) "") }}
            - name: MC_GID_INDEX  # Mooncake's own setting: the RoCE GID index of the NIC
              value: {{ $.Values.rdma.gidIndex | quote }}
            {{- end }}
            {{- with $tier.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $tier.port }}
              protocol: TCP
          {{- with (include "pdserve.probes" (dict "port" "http" "startup" $.Values.pd.startupProbe) | trim) }}{{ . | nindent 10 }}{{- end }}
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $sc }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with (include "pdserve.preStop" (dict "seconds" $pd.preStopSleepS) | trim) }}{{ . | nindent 10 }}{{- end }}
          {{- $mounts := printf "%s\n%s" (include "pdserve.modelMounts" $ | trim) (include "pdserve.tokenMount" $ | trim) | trim }}
          {{- if $mounts }}
          volumeMounts:
            {{- $mounts | nindent 12 }}
          {{- end }}
      {{- $vols := printf "%s\n%s" (include "pdserve.modelVolumes" $ | trim) (include "pdserve.tokenVolume" $ | trim) | trim }}
      {{- if $vols }}
      volumes:
        {{- $vols | nindent 8 }}
      {{- end }}
      {{- include "pdserve.topologySpread" (dict "ctx" $ "component" $role) | nindent 6 }}
      {{- with $tier.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tier.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tier.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
# Headless Service: stable DNS per pod and the target of the ServiceMonitor. Clients do not
# call the nodes through it; the router finds them in the registry.
apiVersion: v1
kind: Service
metadata:
  name: {{ $fullname }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" (dict "ctx" $ "component" $role) | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "pdserve.selectorLabels" (dict "ctx" $ "component" $role) | nindent 4 }}
  ports:
    - name: http
      port: {{ $tier.port }}
      targetPort: http
      protocol: TCP
{{- end -}}
